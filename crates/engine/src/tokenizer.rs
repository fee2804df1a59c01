use crate::error::{EngineError, Result};

/// Padding, never generated and never attended to by a real token.
pub const PAD: u32 = 0;
/// Starts every prompt.
pub const BOS: u32 = 1;
/// Ends every completion.
pub const EOS: u32 = 2;

/// Everything the tasks write: operands, operators and separators.
const ALPHABET: &[u8] = b"0123456789+-*=(),:";
const SPECIAL_TOKENS: u32 = 3;

/// A character-level tokenizer over the tasks' alphabet: token `3 + i` is the i-th
/// character of the alphabet, below it the three special tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokenizer;

impl Tokenizer {
    pub const fn vocab_size(&self) -> usize {
        SPECIAL_TOKENS as usize + ALPHABET.len()
    }

    /// The tokens of `text`, without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.char_indices()
            .map(|(offset, character)| {
                ALPHABET
                    .iter()
                    .position(|&c| char::from(c) == character)
                    .map(|index| SPECIAL_TOKENS + index as u32)
                    .ok_or(EngineError::UnknownCharacter { character, offset })
            })
            .collect()
    }

    /// A prompt's model input: BOS then the text.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        let mut tokens = Vec::with_capacity(prompt.len() + 1);
        tokens.push(BOS);
        tokens.extend(self.encode(prompt)?);
        Ok(tokens)
    }

    /// The text of `tokens` up to the first EOS; other special tokens and ids outside
    /// the vocabulary are skipped, so any token sequence decodes.
    pub fn decode(&self, tokens: &[u32]) -> String {
        tokens
            .iter()
            .take_while(|&&t| t != EOS)
            .filter_map(|&t| t.checked_sub(SPECIAL_TOKENS))
            .filter_map(|index| ALPHABET.get(index as usize).map(|&c| char::from(c)))
            .collect()
    }

    /// A supervised completion: the text then EOS.
    pub fn encode_completion(&self, text: &str) -> Result<Vec<u32>> {
        let mut tokens = self.encode(text)?;
        tokens.push(EOS);
        Ok(tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn encodes_the_alphabet_after_the_special_tokens() {
        let tokenizer = Tokenizer;
        assert_eq!(tokenizer.vocab_size(), 21);
        assert_eq!(tokenizer.encode("0").unwrap(), vec![3]);
        assert_eq!(tokenizer.encode(":").unwrap(), vec![20]);
        assert_eq!(
            tokenizer.encode_prompt("12+3=").unwrap(),
            vec![BOS, 4, 5, 13, 6, 16]
        );
        assert_eq!(tokenizer.encode_completion("15").unwrap(), vec![4, 8, EOS]);
    }

    #[test]
    fn refuses_characters_outside_the_alphabet_by_position() {
        let error = Tokenizer.encode("12+a").unwrap_err();
        assert!(matches!(
            error,
            EngineError::UnknownCharacter {
                character: 'a',
                offset: 3
            }
        ));
        assert!(error.to_string().contains("'a'"));
    }

    #[test]
    fn decode_stops_at_eos_and_skips_what_is_not_text() {
        let tokenizer = Tokenizer;
        assert_eq!(tokenizer.decode(&[4, 5, EOS, 6]), "12");
        assert_eq!(tokenizer.decode(&[BOS, 4, PAD, 5, 999]), "12");
        assert_eq!(tokenizer.decode(&[]), "");
    }

    proptest! {
        #[test]
        fn text_round_trips(text in "[0-9+*=(),:-]{0,40}") {
            let tokenizer = Tokenizer;
            let tokens = tokenizer.encode(&text).unwrap();
            prop_assert_eq!(tokens.len(), text.len());
            prop_assert!(tokens.iter().all(|&t| t >= SPECIAL_TOKENS && (t as usize) < tokenizer.vocab_size()));
            prop_assert_eq!(tokenizer.decode(&tokens), text.clone());
            prop_assert_eq!(tokenizer.decode(&tokenizer.encode_completion(&text).unwrap()), text);
        }
    }
}
