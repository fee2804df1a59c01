//! Tasks with verifiable rewards, generated deterministically from (seed, prompt id).
//!
//! Problems split by a hash of their prompt text into a training part (7/8) and a
//! held-out part (1/8), so evaluation problems never appear in training, whatever the
//! seed or prompt ids.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::rng;

/// Widest addition operands (sums stay far from overflow).
pub const MAX_ADDITION_DIGITS: u32 = 9;
/// Countdown draws between 2 and this many numbers.
pub const MAX_COUNTDOWN_NUMBERS: u32 = 6;
pub const MAX_COUNTDOWN_NUMBER: u32 = 99;
/// Largest target a countdown problem asks for.
pub const MAX_COUNTDOWN_TARGET: i64 = 999;
/// Largest held-out set [`Task::held_out`] builds.
pub const MAX_HELD_OUT: usize = 100_000;
/// Longest completion the countdown checker parses; longer ones score zero.
pub const MAX_EXPRESSION_CHARS: usize = 128;
/// Deepest parenthesis nesting the countdown checker follows.
pub const MAX_EXPRESSION_DEPTH: usize = 16;

/// One problem in this many is held out.
const HELD_OUT_SHARE: u64 = 8;
/// Fixed key of the split, independent of any seed: a problem is held out for every run.
const HELD_OUT_KEY: u64 = 0x6865_6c64_2d6f_7574;
/// Draws before a training problem is given up on. Each draw is held out with
/// probability 1/8, so running out means a broken task, not bad luck (p = 2^-192).
const MAX_DRAWS: u64 = 64;
/// Prompt ids of held-out problems carry this bit, so their sampling seeds never meet a
/// training prompt's.
pub const HELD_OUT_ID_BIT: u64 = 1 << 63;

/// What kind of problems, and how hard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TaskKind {
    /// "a+b=" with both operands written with exactly `digits` digits (zero-padded, so
    /// digit positions line up); the answer is the sum with `digits + 1` digits, e.g.
    /// "042+917=" asks for "0959".
    Addition { digits: u32 },
    /// "n1,n2,...:t=" asks for an expression with + - * and parentheses that uses each
    /// number exactly once and evaluates to t; any such expression is correct.
    Countdown { numbers: u32, max_number: u32 },
}

/// A problem stream: the kind and the seed that draws its problems.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub kind: TaskKind,
    pub seed: u64,
}

/// One problem: the prompt text, one correct completion (the warm-up's target) and what
/// the reward checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub prompt_id: u64,
    pub prompt: String,
    pub solution: String,
    check: Check,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Check {
    Exact,
    Countdown { numbers: Vec<i64>, target: i64 },
}

impl Problem {
    /// 1.0 for a correct completion (the text before EOS), else 0.0.
    pub fn reward(&self, completion: &str) -> f32 {
        let correct = match &self.check {
            Check::Exact => completion == self.solution,
            Check::Countdown { numbers, target } => countdown_correct(numbers, *target, completion),
        };
        if correct { 1.0 } else { 0.0 }
    }
}

impl Task {
    pub fn addition(digits: u32, seed: u64) -> Self {
        Task {
            kind: TaskKind::Addition { digits },
            seed,
        }
    }

    pub fn countdown(numbers: u32, max_number: u32, seed: u64) -> Self {
        Task {
            kind: TaskKind::Countdown {
                numbers,
                max_number,
            },
            seed,
        }
    }

    pub fn validate(&self) -> Result<()> {
        match self.kind {
            TaskKind::Addition { digits } if !(1..=MAX_ADDITION_DIGITS).contains(&digits) => {
                Err(EngineError::Task(format!(
                    "addition digits {digits} is outside 1..={MAX_ADDITION_DIGITS}"
                )))
            }
            TaskKind::Countdown { numbers, .. }
                if !(2..=MAX_COUNTDOWN_NUMBERS).contains(&numbers) =>
            {
                Err(EngineError::Task(format!(
                    "countdown numbers {numbers} is outside 2..={MAX_COUNTDOWN_NUMBERS}"
                )))
            }
            TaskKind::Countdown { max_number, .. }
                if !(2..=MAX_COUNTDOWN_NUMBER).contains(&max_number) =>
            {
                Err(EngineError::Task(format!(
                    "countdown max_number {max_number} is outside 2..={MAX_COUNTDOWN_NUMBER}"
                )))
            }
            _ => Ok(()),
        }
    }

    /// The training problem with this id: the same for every caller, never held out.
    pub fn problem(&self, prompt_id: u64) -> Result<Problem> {
        self.validate()?;
        (0..MAX_DRAWS)
            .map(|draw| self.draw(&[self.seed, prompt_id, draw], prompt_id))
            .find(|problem| !is_held_out(&problem.prompt))
            .ok_or_else(|| {
                EngineError::Task(format!(
                    "no training problem for prompt {prompt_id} in {MAX_DRAWS} draws"
                ))
            })
    }

    /// `count` distinct held-out problems, the same for a given task. Their prompt ids
    /// are `HELD_OUT_ID_BIT | index`.
    pub fn held_out(&self, count: usize) -> Result<Vec<Problem>> {
        self.validate()?;
        if count > MAX_HELD_OUT {
            return Err(EngineError::Task(format!(
                "{count} held-out problems requested, at most {MAX_HELD_OUT}"
            )));
        }
        let mut seen = HashSet::new();
        let mut problems = Vec::with_capacity(count);
        let draws_max = (count as u64 + 16) * HELD_OUT_SHARE * 8;
        for draw in 0..draws_max {
            if problems.len() == count {
                break;
            }
            let id = HELD_OUT_ID_BIT | problems.len() as u64;
            let problem = self.draw(&[self.seed, HELD_OUT_KEY, draw], id);
            if is_held_out(&problem.prompt) && seen.insert(problem.prompt.clone()) {
                problems.push(problem);
            }
        }
        if problems.len() < count {
            return Err(EngineError::Task(format!(
                "found only {} distinct held-out problems of {count} requested",
                problems.len()
            )));
        }
        Ok(problems)
    }

    /// Longest prompt text in characters (BOS not counted).
    pub fn max_prompt_chars(&self) -> usize {
        match self.kind {
            TaskKind::Addition { digits } => 2 * digits as usize + 2,
            TaskKind::Countdown {
                numbers,
                max_number,
            } => {
                let number = decimal_width(max_number as i64);
                numbers as usize * (number + 1) + decimal_width(MAX_COUNTDOWN_TARGET) + 1
            }
        }
    }

    /// Longest completion worth generating, in tokens (EOS included): the longest
    /// correct answer with room for parentheses.
    pub fn max_completion_tokens(&self) -> usize {
        match self.kind {
            TaskKind::Addition { digits } => digits as usize + 2,
            TaskKind::Countdown {
                numbers,
                max_number,
            } => numbers as usize * (decimal_width(max_number as i64) + 3) + 1,
        }
    }

    fn draw(&self, keys: &[u64], prompt_id: u64) -> Problem {
        let key = |k: u64| {
            let mut all = keys.to_vec();
            all.push(k);
            all
        };
        match self.kind {
            TaskKind::Addition { digits } => {
                let width = digits as usize;
                let limit = 10u64.pow(digits);
                let (a, b) = (rng::below(&key(0), limit), rng::below(&key(1), limit));
                Problem {
                    prompt_id,
                    prompt: format!("{a:0width$}+{b:0width$}="),
                    solution: format!("{:0sum_width$}", a + b, sum_width = width + 1),
                    check: Check::Exact,
                }
            }
            TaskKind::Countdown {
                numbers: count,
                max_number,
            } => {
                let numbers: Vec<i64> = (0..count as u64)
                    .map(|i| 1 + rng::below(&key(i), max_number as u64) as i64)
                    .collect();
                let (solution, target) = countdown_solution(&numbers, &key(100));
                let listed: Vec<String> = numbers.iter().map(i64::to_string).collect();
                Problem {
                    prompt_id,
                    prompt: format!("{}:{target}=", listed.join(",")),
                    solution,
                    check: Check::Countdown { numbers, target },
                }
            }
        }
    }
}

fn is_held_out(prompt: &str) -> bool {
    rng::hash_bytes(HELD_OUT_KEY, prompt.as_bytes()).is_multiple_of(HELD_OUT_SHARE)
}

fn decimal_width(value: i64) -> usize {
    value.to_string().len()
}

/// A random expression over a random order of `numbers` and its value, retried until the
/// value is a valid target; all additions is the fallback (always valid, since the
/// numbers are positive and small).
fn countdown_solution(numbers: &[i64], keys: &[u64]) -> (String, i64) {
    const OPS: [char; 3] = ['+', '-', '*'];
    const ATTEMPTS: u64 = 16;
    let key = |a: u64, b: u64| {
        let mut all = keys.to_vec();
        all.extend([a, b]);
        all
    };
    for attempt in 0..ATTEMPTS {
        let mut order = numbers.to_vec();
        for i in (1..order.len()).rev() {
            let j = rng::below(&key(attempt, i as u64), i as u64 + 1) as usize;
            order.swap(i, j);
        }
        let mut text = order[0].to_string();
        for (i, number) in order.iter().enumerate().skip(1) {
            let op = OPS[rng::below(&key(attempt, 1000 + i as u64), 3) as usize];
            text.push(op);
            text.push_str(&number.to_string());
        }
        if let Some(value) = evaluate(&text)
            && (0..=MAX_COUNTDOWN_TARGET).contains(&value.value)
        {
            return (text, value.value);
        }
    }
    let text: Vec<String> = numbers.iter().map(i64::to_string).collect();
    (text.join("+"), numbers.iter().sum())
}

fn countdown_correct(numbers: &[i64], target: i64, completion: &str) -> bool {
    if completion.len() > MAX_EXPRESSION_CHARS {
        return false;
    }
    let Some(mut parsed) = evaluate(completion) else {
        return false;
    };
    let mut expected = numbers.to_vec();
    expected.sort_unstable();
    parsed.numbers.sort_unstable();
    parsed.value == target && parsed.numbers == expected
}

struct Evaluation {
    value: i64,
    numbers: Vec<i64>,
}

/// Evaluates an expression of non-negative integers, + - * and parentheses with the
/// usual precedence; None for anything malformed, too deep or overflowing.
fn evaluate(text: &str) -> Option<Evaluation> {
    let mut parser = Parser {
        bytes: text.as_bytes(),
        position: 0,
        numbers: Vec::new(),
    };
    let value = parser.expression(0)?;
    (parser.position == parser.bytes.len()).then_some(Evaluation {
        value,
        numbers: parser.numbers,
    })
}

struct Parser<'a> {
    bytes: &'a [u8],
    position: usize,
    numbers: Vec<i64>,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.position).copied()
    }

    fn expression(&mut self, depth: usize) -> Option<i64> {
        let mut value = self.term(depth)?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.position += 1;
            let rhs = self.term(depth)?;
            value = if op == b'+' {
                value.checked_add(rhs)?
            } else {
                value.checked_sub(rhs)?
            };
        }
        Some(value)
    }

    fn term(&mut self, depth: usize) -> Option<i64> {
        let mut value = self.factor(depth)?;
        while self.peek() == Some(b'*') {
            self.position += 1;
            value = value.checked_mul(self.factor(depth)?)?;
        }
        Some(value)
    }

    fn factor(&mut self, depth: usize) -> Option<i64> {
        match self.peek()? {
            b'(' if depth < MAX_EXPRESSION_DEPTH => {
                self.position += 1;
                let value = self.expression(depth + 1)?;
                (self.peek() == Some(b')')).then(|| self.position += 1)?;
                Some(value)
            }
            b'0'..=b'9' => {
                let start = self.position;
                while matches!(self.peek(), Some(b'0'..=b'9')) {
                    self.position += 1;
                }
                // Bounded by MAX_EXPRESSION_CHARS, but a long digit run must not overflow.
                let value: i64 = std::str::from_utf8(&self.bytes[start..self.position])
                    .ok()?
                    .parse()
                    .ok()?;
                self.numbers.push(value);
                Some(value)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    #[test]
    fn addition_problems_are_deterministic_fixed_width_and_correct() {
        let task = Task::addition(3, 7);
        let mut leading_zero = false;
        for id in 0..300 {
            let problem = task.problem(id).unwrap();
            assert_eq!(problem, task.problem(id).unwrap());
            assert_eq!(problem.prompt.len(), task.max_prompt_chars());
            let (a, b) = problem
                .prompt
                .trim_end_matches('=')
                .split_once('+')
                .unwrap();
            assert_eq!((a.len(), b.len(), problem.solution.len()), (3, 3, 4));
            leading_zero |= a.starts_with('0');
            let sum = a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap();
            assert_eq!(problem.solution.parse::<u64>().unwrap(), sum);
            assert_eq!(problem.reward(&problem.solution), 1.0);
            assert_eq!(
                problem.reward(&sum.to_string()),
                if sum >= 1000 { 1.0 } else { 0.0 }
            );
            assert_eq!(problem.reward(&format!("{}0", problem.solution)), 0.0);
            assert_eq!(problem.reward(""), 0.0);
            let completion = Tokenizer.encode_completion(&problem.solution).unwrap();
            assert_eq!(completion.len(), task.max_completion_tokens());
        }
        assert!(leading_zero);
        assert_ne!(
            task.problem(0).unwrap().prompt,
            Task::addition(3, 8).problem(0).unwrap().prompt
        );
        let example = Problem {
            prompt_id: 0,
            prompt: "042+917=".into(),
            solution: "0959".into(),
            check: Check::Exact,
        };
        assert_eq!(example.reward("0959"), 1.0);
        assert_eq!(example.reward("959"), 0.0);
    }

    #[test]
    fn held_out_problems_are_distinct_and_never_drawn_for_training() {
        for task in [Task::addition(2, 3), Task::countdown(3, 9, 3)] {
            let held_out = task.held_out(200).unwrap();
            let prompts: HashSet<&str> = held_out.iter().map(|p| p.prompt.as_str()).collect();
            assert_eq!(prompts.len(), 200);
            assert_eq!(held_out, task.held_out(200).unwrap());
            assert!(held_out.iter().all(|p| p.prompt_id & HELD_OUT_ID_BIT != 0));
            for id in 0..5000 {
                let problem = task.problem(id).unwrap();
                assert!(
                    !prompts.contains(problem.prompt.as_str()),
                    "{}",
                    problem.prompt
                );
            }
        }
    }

    #[test]
    fn held_out_refuses_more_problems_than_exist_or_allowed() {
        // 1-digit addition has 100 problems, about an eighth of them held out.
        let message = Task::addition(1, 0).held_out(50).unwrap_err().to_string();
        assert!(message.contains("distinct held-out"), "{message}");
        let message = Task::addition(3, 0)
            .held_out(MAX_HELD_OUT + 1)
            .unwrap_err()
            .to_string();
        assert!(message.contains("at most"), "{message}");
    }

    #[test]
    fn countdown_solutions_are_correct_and_other_answers_checked() {
        let task = Task::countdown(4, 20, 5);
        for id in 0..300 {
            let problem = task.problem(id).unwrap();
            assert_eq!(problem.reward(&problem.solution), 1.0, "{problem:?}");
            assert!(
                problem.prompt.len() <= task.max_prompt_chars(),
                "{}",
                problem.prompt
            );
            assert!(problem.solution.len() < task.max_completion_tokens());
            Tokenizer.encode_prompt(&problem.prompt).unwrap();
        }
        let problem = Problem {
            prompt_id: 0,
            prompt: "3,5,7:26=".into(),
            solution: "3*7+5".into(),
            check: Check::Countdown {
                numbers: vec![3, 5, 7],
                target: 26,
            },
        };
        for (answer, reward) in [
            ("5+7*3", 1.0),
            ("(5)+(3*7)", 1.0),
            ("7*3+5+0", 0.0),
            ("3*7+5*1", 0.0),
            ("21+5", 0.0),
            ("3*7+5)", 0.0),
            ("(3*7+5", 0.0),
            ("3*(7+5)", 0.0),
            ("", 0.0),
            ("3**7", 0.0),
            ("99999999999999999999*3", 0.0),
        ] {
            assert_eq!(problem.reward(answer), reward, "{answer}");
        }
        let deep = format!(
            "{}3*7+5{}",
            "(".repeat(MAX_EXPRESSION_DEPTH),
            ")".repeat(MAX_EXPRESSION_DEPTH)
        );
        assert_eq!(problem.reward(&deep), 1.0);
        let too_deep = format!("({deep})");
        assert_eq!(problem.reward(&too_deep), 0.0);
        let too_long = format!("{}3*7+5", "0+".repeat(MAX_EXPRESSION_CHARS));
        assert_eq!(problem.reward(&too_long), 0.0);
    }

    #[test]
    fn invalid_tasks_are_refused_by_name() {
        let check = |task: Task, expected: &str| {
            let message = task.problem(0).unwrap_err().to_string();
            assert!(message.contains(expected), "{message}");
        };
        check(Task::addition(0, 0), "digits 0");
        check(Task::addition(MAX_ADDITION_DIGITS + 1, 0), "digits 10");
        check(Task::countdown(1, 9, 0), "numbers 1");
        check(Task::countdown(3, 100, 0), "max_number 100");
        Task::addition(MAX_ADDITION_DIGITS, 0).problem(0).unwrap();
        Task::countdown(MAX_COUNTDOWN_NUMBERS, MAX_COUNTDOWN_NUMBER, 0)
            .problem(0)
            .unwrap();
    }

    #[test]
    fn task_serialises_with_a_kind_tag() {
        let task = Task::countdown(3, 9, 11);
        let json = serde_json::to_string(&task).unwrap();
        assert_eq!(
            json,
            r#"{"kind":{"kind":"countdown","numbers":3,"max_number":9},"seed":11}"#
        );
        assert_eq!(serde_json::from_str::<Task>(&json).unwrap(), task);
        assert!(serde_json::from_str::<Task>(r#"{"kind":{"kind":"sorting"},"seed":1}"#).is_err());
    }
}
